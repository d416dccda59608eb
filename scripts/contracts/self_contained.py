"""An import-linter contract: a package imports, of its own project, only itself and the ground layer.

The simulated upstream must never agree with the broker by sharing its code, so it may import nothing of
`mergebroker` but its own modules and the ground (the root package's own modules). Named as packages, so
a module added to the providers later is covered without a list to keep up to date.
"""

from __future__ import annotations

from importlinter import Contract, ContractCheck, fields, output


class SelfContainedContract(Contract):
    """`source` (and its descendants) imports nothing under `root` but itself and `root`'s own modules,
    the ground (every module directly in `root` that is not one of the `layers` packages)."""

    source = fields.StringField()
    root = fields.StringField()
    layers = fields.ListField(subfield=fields.StringField())

    def check(self, graph, verbose: bool) -> ContractCheck:  # noqa: ANN001 - grimp's graph
        above = [f"{self.root}.{layer}" for layer in self.layers]
        ground = {m for m in graph.find_children(self.root) if m not in above}
        modules = {self.source} | graph.find_descendants(self.source)
        broken = []
        for module in sorted(modules):
            for imported in sorted(graph.find_modules_directly_imported_by(module)):
                inside = imported == self.source or imported.startswith(self.source + ".")
                ours = imported == self.root or imported.startswith(self.root + ".")
                grounded = imported == self.root or any(imported == g or imported.startswith(g + ".") for g in ground)
                if ours and not inside and not grounded:
                    broken.append((module, imported))
        return ContractCheck(kept=not broken, metadata={"broken": broken})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for module, imported in check.metadata["broken"]:
            output.print_error(f"{module} imports {imported}: only its own package and the ground are allowed")
