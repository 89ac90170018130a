"""Errors the engine raises to its caller (bad requests never raise: they become
outputs with finish_reason "error")."""


class ModelLoadError(ValueError):
    """The checkpoint cannot be loaded; the message names the file and what to fix."""


class EngineConfigError(ValueError):
    """An engine option is out of range; the message names the option and the limit."""
