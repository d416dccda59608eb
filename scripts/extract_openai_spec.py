"""Extract the operations mergebroker serves from the official OpenAI OpenAPI spec.

Usage, from a checkout of the openai/openai-openapi repository (MIT licence):

    python scripts/extract_openai_spec.py path/to/openapi.yaml --commit <sha> --date <yyyy-mm-dd> \
        > tests/data/openai_spec_subset.yaml

Keeps the listed operations and every component they reference (transitively); drops the documentation-only
parts (`x-oaiMeta`, prose `description`s) so the extract stays small enough to read and to load in tests.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any

import yaml

OPERATIONS: dict[str, tuple[str, ...]] = {
    "/chat/completions": ("post",),
    "/embeddings": ("post",),
    "/models": ("get",),
    "/models/{model}": ("get",),
    "/files": ("post", "get"),
    "/files/{file_id}": ("get", "delete"),
    "/files/{file_id}/content": ("get",),
    "/batches": ("post", "get"),
    "/batches/{batch_id}": ("get",),
    "/batches/{batch_id}/cancel": ("post",),
}
"""Path -> the methods mergebroker answers (the spec's other methods on these paths are left out)."""

_DOC_ONLY = ("x-oaiMeta",)


def _trim(node: Any, *, named: bool = False) -> Any:
    """`node` without documentation-only keys. Under `properties` the keys are field names, never dropped."""
    if isinstance(node, list):
        return [_trim(n) for n in node]
    if not isinstance(node, dict):
        return node
    kept = {}
    for key, value in node.items():
        if not named and (key in _DOC_ONLY or (key == "description" and isinstance(value, str))):
            continue
        kept[key] = _trim(value, named=not named and key in ("properties", "patternProperties"))
    return kept


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/"):
            yield ref
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def extract(spec: dict[str, Any]) -> dict[str, Any]:
    """The subset of `spec`: the chosen operations and the closure of the components they reference."""
    paths = {path: {m: _trim(spec["paths"][path][m]) for m in methods} for path, methods in OPERATIONS.items()}
    components: dict[str, dict[str, Any]] = {}
    pending = list(_refs(paths))
    while pending:
        section, name = pending.pop().removeprefix("#/components/").split("/", 1)
        if name in components.get(section, {}):
            continue
        node = _trim(spec["components"][section][name])
        components.setdefault(section, {})[name] = node
        pending.extend(_refs(node))
    components["securitySchemes"] = spec["components"]["securitySchemes"]
    return {
        "openapi": spec["openapi"],
        "info": {k: spec["info"][k] for k in ("title", "version", "license")},
        "servers": spec["servers"],
        "security": spec["security"],
        "paths": paths,
        "components": {section: dict(sorted(items.items())) for section, items in sorted(components.items())},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="openapi.yaml from the openai/openai-openapi repository")
    parser.add_argument("--commit", required=True, help="the repository commit the spec comes from")
    parser.add_argument("--date", required=True, help="that commit's date")
    args = parser.parse_args(argv)
    with open(args.spec, encoding="utf-8") as f:
        spec = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    sys.stdout.write(
        "# A trimmed extract of the official OpenAI OpenAPI spec: openapi.yaml of the openai/openai-openapi\n"
        f"# repository (MIT licence), commit {args.commit} of {args.date}.\n"
        "# Only the operations mergebroker serves and the components they reference, without the\n"
        "# documentation-only parts.\n"
        "# Regenerate with scripts/extract_openai_spec.py; do not edit by hand.\n")
    yaml.dump(extract(spec), sys.stdout, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False,
              allow_unicode=True, width=120)


if __name__ == "__main__":
    main()
