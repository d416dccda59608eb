"""An import-linter contract: the ground layer (the root package's own modules) imports no layer above it.

The ground (`core/`) is installed as the root package `mergebroker` itself, so no `layers` contract can
name it as one layer: every module is a descendant of the root. Here it is named as a package: every
module directly in `root` that is not one of the `layers` packages, now and as modules are added.
"""

from __future__ import annotations

from importlinter import Contract, ContractCheck, fields, output


class GroundContract(Contract):
    """The modules directly in `root` (its ground) import nothing from the `layers` packages."""

    root = fields.StringField()
    layers = fields.ListField(subfield=fields.StringField())

    def check(self, graph, verbose: bool) -> ContractCheck:  # noqa: ANN001 - grimp's graph
        above = [f"{self.root}.{layer}" for layer in self.layers]
        ground = {m for m in graph.find_children(self.root) if m not in above}
        ground.add(self.root)
        broken = []
        for module in sorted(ground):
            for imported in sorted(graph.find_modules_directly_imported_by(module)):
                if any(imported == a or imported.startswith(a + ".") for a in above):
                    broken.append((module, imported))
        return ContractCheck(kept=not broken, metadata={"broken": broken})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for module, imported in check.metadata["broken"]:
            output.print_error(f"the ground module {module} imports {imported}, a layer above it")
