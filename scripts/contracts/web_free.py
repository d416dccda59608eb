"""An import-linter contract: the named packages never import aiohttp's server side (`aiohttp.web`).

import-linter sees an external package only as its top-level name (`aiohttp`), so a `forbidden` contract
cannot tell the HTTP client (allowed everywhere) from the server (the ways in only). This contract reads
the import lines grimp records for each `aiohttp` import instead.
"""

from __future__ import annotations

import re

from importlinter import Contract, ContractCheck, fields, output

_WEB = re.compile(r"\baiohttp\.web\b|from\s+aiohttp\s+import\s+[^#]*\bweb\b")


class WebFreeContract(Contract):
    """`source_modules` (and their descendants) never import `aiohttp.web`; `ignore_modules` are left out."""

    source_modules = fields.ListField(subfield=fields.ModuleExpressionField())
    ignore_modules = fields.ListField(subfield=fields.ModuleExpressionField(), required=False, default=[])

    def check(self, graph, verbose: bool) -> ContractCheck:  # noqa: ANN001 - grimp's graph
        ignored = {m.expression for m in self.ignore_modules}
        broken = []
        for source in self.source_modules:
            modules = {source.expression} | graph.find_descendants(source.expression)
            for module in sorted(modules):
                if any(module == i or module.startswith(i + ".") for i in ignored):
                    continue
                if "aiohttp" not in graph.find_modules_directly_imported_by(module):
                    continue
                for detail in graph.get_import_details(importer=module, imported="aiohttp"):
                    if _WEB.search(detail["line_contents"]):
                        broken.append((module, detail["line_number"], detail["line_contents"]))
        return ContractCheck(kept=not broken, metadata={"broken": broken})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for module, line, contents in check.metadata["broken"]:
            output.print_error(f"{module}:{line} imports the HTTP server: {contents}")
