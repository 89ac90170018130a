"""Errors the engine raises to its caller (bad requests never raise: they become
outputs with finish_reason "error")."""


class ModelLoadError(ValueError):
    """The checkpoint cannot be loaded; the message names the file and what to fix."""


class EngineConfigError(ValueError):
    """An engine option is out of range; the message names the option and the limit."""


class DeviceGroupError(RuntimeError):
    """A rank of the engine's device group died, failed or stopped answering: the group
    is gone, so every request in it fails with this message (code device_group_failed)
    and the engine cannot step again; a job retries the partition on a fresh engine."""
    code = "device_group_failed"
