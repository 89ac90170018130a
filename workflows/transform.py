"""Light transforms over one table at a time: drop error rows, filter, select, rename.

Applied in that order. The same `apply` runs on every partition and, at validation, on an
empty table of the input schema: so the output schema and every column or type problem
are known before any row is read.
"""
from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from fusegen.workflows.errors import Problem
from fusegen.workflows.expr import Expression


@dataclass(slots=True)
class Transform:
    drop_errors: bool = False  # keep rows whose `error` is null
    filter: Expression | None = None  # keep rows where it is true (null counts as false)
    select: list[str] | None = None  # keep these columns, in this order
    rename: dict[str, str] | None = None  # old name -> new name, after select

    @classmethod
    def from_options(cls, options: dict) -> "Transform":
        """Raises ExpressionError for a bad filter (the caller names the step)."""
        text = options.get("filter")
        return cls(drop_errors=bool(options.get("drop_errors", False)),
                   filter=Expression(text) if text is not None else None,
                   select=list(options["select"]) if options.get("select") else None,
                   rename=dict(options["rename"]) if options.get("rename") else None)

    def config(self) -> dict:
        """What the output depends on (with the inputs): the fingerprint's config."""
        return {"drop_errors": self.drop_errors,
                "filter": self.filter.source if self.filter else None,
                "select": self.select, "rename": self.rename}

    def problems(self, step: str, columns: list[str], origin: str) -> list[Problem]:
        """Columns it reads that its input does not have, named by key."""
        have, out = set(columns), []

        def missing(key, names):
            for name in names:
                if name not in have:
                    out.append(Problem(step, key, f"column {name!r} is not provided by "
                                       f"{origin}; its columns are {', '.join(columns)}"))

        if self.drop_errors:
            missing("drop_errors", ["error"])
        if self.filter is not None:
            missing("filter", sorted(self.filter.columns))
        if self.select:
            missing("select", self.select)
            have = set(self.select)
        if self.rename:
            missing("rename", list(self.rename))
            after = [self.rename.get(c, c) for c in (self.select or columns)]
            clashes = sorted({c for c in after if after.count(c) > 1})
            if clashes:
                out.append(Problem(step, "rename", f"gives two columns named "
                                   f"{', '.join(map(repr, clashes))}; rename or drop one"))
        return out

    def apply(self, table: pa.Table) -> pa.Table:
        if self.drop_errors:
            table = table.filter(pc.is_null(table.column("error")))
        if self.filter is not None:
            table = table.filter(self.filter.mask(table))
        if self.select:
            table = table.select(self.select)
        if self.rename:
            table = table.rename_columns([self.rename.get(c, c) for c in table.column_names])
        return table

    def output_schema(self, schema: pa.Schema) -> pa.Schema:
        """Raises ExpressionError when the filter does not type-check on this schema."""
        return self.apply(schema.empty_table()).schema
