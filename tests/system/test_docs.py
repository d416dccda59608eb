"""The docs name only code that exists, and the README's defaults are the code's defaults.

Every backticked token of README.md and docs/*.md (and every file path in their plain fenced diagrams) that
looks like code is resolved against the checkout, without importing it (an ast walk of the tree: fast, and a
module that needs torch costs nothing):

- a file path (`broker/engine/handling.py`, `chat/service.py`, `bench/`) must be a file or folder of the
  repository, matched by suffix, since the docs write paths from inside a room;
- a dotted name (`mergebroker.broker.engine.limits.admission`, `merge.prompt.ID_PATTERN`, `engine.config`)
  whose head is a module of ours resolves module by module (suffix-matched like paths), then attribute by
  attribute; a call (`name(...)`) must end at a class or function, never at a module;
- `Class.attr` resolves in that class (its body, `self.attr` assignments, its bases); `module.attr` in that
  module (`merge_cost.decide`); `snake_instance.attr` in the class of that name (`broker.chat` -> `Broker`);
- a dotted name whose head is a settings section (`merge.lowercase`, `embeddings.cache_scope`) or the
  request's `broker` object (`broker.timeout_s`) may instead be a field path of that pydantic model;
- a bare CamelCase name with two humps or a call (`ChatService`, `Caller(tenant, tier)`) must be defined
  somewhere in the package; a bare snake_case name (`window_min_partners`, `settle_block`) must be a name the
  code knows: an identifier, a settings or request field, or a string constant (JSON keys, error codes).

Skipped by rule, not by list: tokens holding whitespace other than a call's arguments or a `key: value`
(commands, prose), URLs and absolute, home or parent paths, HTTP routes (`/v1/...`), hyphenated words
(headers, CLI names and options), ALL-CAPS words (environment variables, Redis commands), single words
without an underscore or a second hump (values such as `hit`, `batch`; English such as `Allow`), JSON paths
with an index or a wildcard, and metric names (`mergebroker_*`: Prometheus adds `_total` to counters, so
they are a separate check). What is left is in ALLOWED, each entry with its reason.
"""

from __future__ import annotations

import ast
import re
import subprocess
from dataclasses import dataclass, field
from functools import cache

import pytest
from prometheus_client.metrics import MetricWrapperBase
from pydantic import BaseModel

from mergebroker.broker.engine.ground.lockfree_metrics import LockFreeFamily
from mergebroker.broker.engine.ground.metrics import Metrics
from mergebroker.broker.engine.ground.schemas import ChatRequest
from mergebroker.broker.engine.ground.settings import ProviderSettings, Settings
from tests.helpers.paths import REPO

ROOT = REPO
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
PACKAGES = {"core": "mergebroker", "broker": "mergebroker.broker", "merge": "mergebroker.merge",
            "breaker": "mergebroker.breaker", "providers": "mergebroker.providers", "bench": "bench",
            "scripts": "scripts"}

ALLOWED = {
    "OpenAI": "a company's name, in a diagram",
    "PostgreSQL": "a database's name, in a diagram",
    "client.files.create": "the OpenAI SDK's call, shown to Batch API users",
    "client.files.content": "the OpenAI SDK's call, shown to Batch API users",
    "client.batches.create": "the OpenAI SDK's call, shown to Batch API users",
    "client.batches.retrieve/list/cancel": "the OpenAI SDK's calls, shown to Batch API users",
}

_FENCE = re.compile(r"^```(\w*)\s*$")
_INLINE = re.compile(r"``?([^`\n]+?)``?")
_IDENT = r"[A-Za-z_]\w*"
_CALL = re.compile(rf"^({_IDENT}(?:\.{_IDENT})*)\((?!s\))(.*)\)(\s*->\s*.*)?$")  # not a plural: `http(s)`
_KEY_VALUE = re.compile(rf"^({_IDENT}(?:\.{_IDENT})*):\s+\S.*$")
_DOTTED = re.compile(rf"^{_IDENT}(?:\.{_IDENT})+$")
_PATH = re.compile(r"^[\w.-]+(?:/[\w.-]+)*/?$")
_PATH_WORD = re.compile(r"[\w./-]*[\w-]+(?:\.py|/)(?=[\s,;:)]|$)")
_FENCED_NAME = re.compile(r"(?<![\w./-])(?:mergebroker(?:\.\w+)+|[A-Z][a-z]+[A-Z]\w*|[a-z]+_\w*[a-z])(?![\w/-])")
_DATA_FILE = re.compile(r"\.(md|json|jsonl|png|ya?ml|sqlite3|toml|txt|csv)$")
_HUMPS = re.compile(r"[a-z0-9][A-Z]")
_DEFAULT_AFTER = re.compile(r"`(\w+)` \((?:default )?([\d,._]+)\s*(ms|s|MiB|KiB)?\)")


@dataclass
class Tree:
    """What the checkout defines, read with ast: files, modules and their names, classes and their attributes."""

    files: set[str] = field(default_factory=set)
    dirs: set[str] = field(default_factory=set)
    modules: dict[str, set[str]] = field(default_factory=dict)  # dotted module -> its top-level names
    callables: set[str] = field(default_factory=set)  # "module.name" of every top-level def and class
    classes: dict[str, list[tuple[set[str], list[str]]]] = field(default_factory=dict)  # name -> (attrs, bases)
    names: set[str] = field(default_factory=set)  # every identifier defined anywhere, and every str constant
    defs: set[str] = field(default_factory=set)  # every function and class name, at any depth


def _module_name(path: str) -> str | None:
    parts = path[:-3].split("/")
    if parts[0] not in PACKAGES:
        return None
    dotted = [PACKAGES[parts[0]], *parts[1:]]
    if dotted[-1] == "__init__":
        dotted.pop()
    return ".".join(dotted)


def _class_attrs(node: ast.ClassDef) -> set[str]:
    attrs: set[str] = set()
    for item in ast.walk(node):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            attrs.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            attrs.add(item.target.id)
        elif isinstance(item, ast.Assign):
            attrs.update(t.id for t in item.targets if isinstance(t, ast.Name))
        if isinstance(item, (ast.Assign, ast.AnnAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            attrs.update(t.attr for t in targets if isinstance(t, ast.Attribute)
                         and isinstance(t.value, ast.Name) and t.value.id == "self")
    return attrs


def _read_module(tree: Tree, module: str, source: str) -> None:
    parsed = ast.parse(source)
    top = tree.modules.setdefault(module, set())
    for node in parsed.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            top.add(node.name)
            tree.callables.add(f"{module}.{node.name}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    top.add(t.id)
                    if t.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                        top.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            top.update((a.asname or a.name).split(".")[0] for a in node.names)
    for node in ast.walk(parsed):
        if isinstance(node, ast.ClassDef):
            bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
            tree.classes.setdefault(node.name, []).append((_class_attrs(node), bases))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            tree.names.add(node.name)
            tree.defs.add(node.name)
        elif isinstance(node, ast.Name):
            tree.names.add(node.id)
        elif isinstance(node, ast.Attribute):
            tree.names.add(node.attr)
        elif isinstance(node, ast.arg) or isinstance(node, ast.keyword) and node.arg:
            tree.names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 200:
            tree.names.add(node.value)


@cache
def repository() -> Tree:
    """The checkout's tracked files (and new ones not ignored), read once per test session."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    tree = Tree()
    for path in listed:
        if not (ROOT / path).is_file():
            continue
        tree.files.add(path)
        parts = path.split("/")
        tree.dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
        module = _module_name(path) if path.endswith(".py") else None
        if module:
            _read_module(tree, module, (ROOT / path).read_text(encoding="utf-8"))
    for module in list(tree.modules):  # a package's submodules are its attributes
        parent, _, leaf = module.rpartition(".")
        tree.names.add(leaf)
        if parent in tree.modules:
            tree.modules[parent].add(leaf)
    return tree


def _models_of(annotation: object) -> list[type[BaseModel]]:
    """The pydantic models inside a field's annotation (`list[TierSettings]`, `BrokerOptions | None`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models_of(arg)]


def _is_field_path(model: type[BaseModel], parts: list[str]) -> bool:
    if not parts or parts == ["*"]:
        return True
    info = model.model_fields.get(parts[0])
    if info is None:
        return False
    inner = _models_of(info.annotation)
    return len(parts) == 1 or any(_is_field_path(m, parts[1:]) for m in inner)


FIELD_ROOTS: dict[str, type[BaseModel]] = {
    **{name: m for name, info in Settings.model_fields.items() for m in _models_of(info.annotation)},
    "broker": _models_of(ChatRequest.model_fields["broker"].annotation)[0],  # the request's own `broker` object
}


def _camel(snake: str) -> str:
    return "".join(part.capitalize() for part in snake.split("_"))


def _class_has(tree: Tree, name: str, attr: str, seen: frozenset[str] = frozenset()) -> bool:
    for attrs, bases in tree.classes.get(name, []):
        if attr in attrs or any(_class_has(tree, b, attr, seen | {name}) for b in bases if b not in seen):
            return True
    return False


def _modules_ending(tree: Tree, dotted: str) -> list[str]:
    return [m for m in tree.modules if m == dotted or m.endswith("." + dotted)]


def _in_module(tree: Tree, module: str, rest: list[str], call: bool) -> bool:
    if not rest:
        return not call  # a module is never called
    name = rest[0]
    if name not in tree.modules[module]:
        return False
    if f"{module}.{name}" in tree.modules:
        return _in_module(tree, f"{module}.{name}", rest[1:], call)
    return len(rest) == 1 or _class_has(tree, name, rest[1]) or name not in tree.classes


def resolves_dotted(tree: Tree, name: str, call: bool = False) -> bool:
    """Whether a dotted name is code of ours (module path, `Class.attr`, `instance.attr`) or a model's field path."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if any(_in_module(tree, m, parts[i:], call) for m in _modules_ending(tree, ".".join(parts[:i]))):
            return True
    if _class_has(tree, parts[0], parts[1]) or len(parts) == 2 and _class_has(tree, _camel(parts[0]), parts[1]):
        return True
    return not call and parts[0] in FIELD_ROOTS and _is_field_path(FIELD_ROOTS[parts[0]], parts[1:])


def _dotted_is_ours(tree: Tree, name: str) -> bool:
    """Whether a dotted name claims to be code or config of ours (else it is a foreign JSON path, skipped)."""
    head = name.split(".")[0]
    return (head in FIELD_ROOTS or head in tree.classes or _camel(head) in tree.classes
            or any(m.rsplit(".", 1)[-1] == head for m in tree.modules) or head == "mergebroker")


def resolves_path(tree: Tree, path: str) -> bool:
    """Whether a repository file or folder has this path, or ends with it (paths written from inside a room)."""
    path = path.rstrip("/")
    return any(p == path or p.endswith("/" + path) for p in (tree.files | tree.dirs))


def _is_callable(tree: Tree, name: str) -> bool:
    """A bare call names a function or class of ours, or an instance of a class with `__call__` (`clock()`)."""
    return name in tree.defs or _class_has(tree, _camel(name), "__call__")


@cache
def exported_metrics() -> dict[str, set[str]]:
    """Exported metric name -> its label names, from a fresh `Metrics` (counters gain `_total`)."""
    found: dict[str, set[str]] = {}
    for family in vars(Metrics()).values():
        if isinstance(family, MetricWrapperBase | LockFreeFamily):
            suffix = "_total" if family._type == "counter" else ""
            found[family._name + suffix] = set(family._labelnames)
    return found


def check_metric(token: str) -> str | None:
    """Why `name{label, ...}` is not a metric the broker exports with those labels; a `*` ends a prefix."""
    name, _, labels = token.partition("{")
    exported = exported_metrics()
    if name.endswith("*"):
        return None if any(m.startswith(name[:-1]) for m in exported) else f"no metric matches {name!r}"
    if name not in exported:
        return f"no metric {name!r}"
    wanted = {part.split("=")[0].strip() for part in labels.rstrip("}").split(",") if part.strip()}
    missing = wanted - exported[name]
    return f"metric {name!r} has no label {sorted(missing)}" if missing else None


@cache
def _ignored(path: str) -> bool:
    """Whether git ignores the path: an output of a run (`bench/results/...`), never a file of the tree."""
    return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT, check=False).returncode == 0


def check_token(tree: Tree, token: str) -> str | None:
    """Why a backticked token names nothing that exists; None when it resolves or is not code by rule."""
    token = token.strip()
    if token in ALLOWED or "://" in token or token.startswith(("/", "~", "..")):
        return None
    ours = token.startswith(("--", "mergebroker ", "python -m ", "scripts/"))  # not docker's, pip's or curl's
    for option in re.findall(r"(?<![\w-])--[a-z][\w-]*", token) if ours else []:
        if option not in tree.names and option[2:].replace("-", "_") not in tree.names:  # a string, or a dest
            return f"no command-line option {option!r}"
    for module in re.findall(r"python -m ([\w.]+)", token):
        if not _modules_ending(tree, module):
            return f"no module {module!r} to run"
    if token.startswith("-"):
        return None
    if token.startswith("mergebroker_"):
        return check_metric(token)
    call = _CALL.match(token)
    key = _KEY_VALUE.match(token)
    name = call.group(1) if call else key.group(1) if key else token
    if re.search(r"\s", name) or name in ALLOWED:
        return None  # a command or prose
    if _PATH.match(name) and ("/" in name or name.endswith(".py")):
        if resolves_path(tree, name) or _ignored(name):
            return None
        return f"no file or folder {name!r}"
    if _DATA_FILE.search(name):
        return None  # a bare file name of another kind: what a command writes or reads (`eval.md`)
    if _DOTTED.match(name):
        if not _dotted_is_ours(tree, name) or resolves_dotted(tree, name, call=bool(call)) or name in tree.names:
            return None
        return f"{name!r} does not resolve" + (" to a class or function" if call else "")
    if name.startswith(".") and re.fullmatch(_IDENT, name[1:]):  # a dotfile, or an attribute (`.retryable`)
        return None if resolves_path(tree, name) or _ignored(name) or name[1:] in tree.names else (
            f"no file or attribute {name!r}")
    if not re.fullmatch(_IDENT, name) or name.isupper():
        return None  # headers, CLI names, environment variables, Redis commands, values with punctuation
    if call:
        return None if _is_callable(tree, name) else f"no class or function {name!r}"
    if name[0].isupper():
        return None if name in tree.names else f"no class or name {name!r}"
    if "_" in name.strip("_") and name.lower() == name:
        return None if name in tree.names else f"no name {name!r} in the code, the settings or its strings"
    return None


def cited_tokens(text: str) -> list[tuple[int, str]]:
    """(line, token) for every inline code span, and every file path in a fenced block without a language."""
    found: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        opened = _FENCE.match(line.strip())
        if opened:
            fence = None if fence is not None else opened.group(1)
            continue
        if fence is None:
            found.extend((number, m.group(1)) for m in _INLINE.finditer(line))
        elif fence == "":  # a diagram: its file paths and the code names in it
            found.extend((number, m.group(0)) for m in _PATH_WORD.finditer(line))
            found.extend((number, m.group(0)) for m in _FENCED_NAME.finditer(line))
    return found


def check_markdown(text: str, tree: Tree | None = None) -> list[str]:
    """Every finding in one document: names that do not resolve, and defaults that differ from `Settings()`."""
    tree = tree or repository()
    findings = [f"line {n}: {why}" for n, token in cited_tokens(text) if (why := check_token(tree, token))]
    return findings + check_defaults(text) + check_sections(text)


_TIER_SENTENCE = re.compile(r"Default tiers:(.*?)\.(?:\s|$)", re.DOTALL)
_TIER_ENTRY = re.compile(r"`(\w+)` \(([^)]*)\)")
_TIER_FIELDS = ("priority", "window_ms", "max_batch", "similarity_threshold")
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
_KEY_DEFAULT = re.compile(r"`([\w.]+)` \((?:[^()`]*?\bdefault )?(\d[\d,]*(?:\.\d+)?)\s*(ms|s|MiB|KiB|x)?\s*[):;,]")
_UNITS = {"MiB": 1024 * 1024, "KiB": 1024}


def _settings_defaults() -> dict[str, list[tuple[str, object]]]:
    """field name -> [(section, default)] over every settings model (a bare key may be in several)."""
    found: dict[str, list[tuple[str, object]]] = {}

    def walk(model: type[BaseModel], section: str) -> None:
        for name, info in model.model_fields.items():
            inner = _models_of(info.annotation)
            if inner:
                for m in inner:
                    walk(m, name)
            elif info.default is not None and isinstance(info.default, (int, float)):
                found.setdefault(name, []).append((section, info.default))

    walk(Settings, "")
    return found


def _doc_value(number: str, unit: str | None, key: str) -> float:
    value = float(number.replace(",", ""))
    if unit == "s" and key.endswith("_ms"):
        return value * 1000
    if unit == "ms" and key.endswith("_s"):
        return value / 1000
    return value * _UNITS.get(unit or "", 1)


def _tier_findings(text: str) -> list[str]:
    sentence = _TIER_SENTENCE.search(" ".join(text.split()))
    if sentence is None:
        return []
    tiers = {t.name: t for t in Settings().tiers}
    findings = []
    for name, inside in _TIER_ENTRY.findall(sentence.group(1)):
        if name not in tiers:
            findings.append(f"default tiers: no built-in tier {name!r}")
            continue
        said = [float(n.replace(",", "")) for n in _NUMBER.findall(inside)]
        if "any compatible" in inside:
            said.append(0.0)  # a threshold of 0: any compatible request may merge
        for fld, value in zip(_TIER_FIELDS, said):
            if value != float(getattr(tiers[name], fld)):
                findings.append(f"default tiers: {name}.{fld} is {getattr(tiers[name], fld)}, the docs say {value:g}")
    return findings


def check_defaults(text: str) -> list[str]:
    """Defaults the text states (the default tiers, "`key` (N unit)") that differ from `Settings()`."""
    defaults = _settings_defaults()
    findings = _tier_findings(text)
    for key, number, unit in _KEY_DEFAULT.findall(text):
        section, _, leaf = key.rpartition(".")
        candidates = [d for s, d in defaults.get(leaf, []) if not section or s == section]
        if candidates and all(float(d) != _doc_value(number, unit, leaf) for d in candidates):
            findings.append(f"default of {key!r} is {' or '.join(map(str, candidates))}, the docs say "
                            f"{number}{' ' + unit if unit else ''}")
    return findings


_SECTION_ROW = re.compile(r"^\| `(\w+)(?:\[\])?` \| (.*) \|$", re.MULTILINE)


def _outside_parentheses(text: str) -> str:
    depth, kept = 0, []
    for char in text:
        depth += char == "("
        if not depth:
            kept.append(char)
        depth -= char == ")" and depth > 0
    return "".join(kept)


def check_sections(text: str) -> list[str]:
    """Keys the configuration table lists per section that the section's settings model does not have."""
    findings = []
    for key in re.findall(r"per provider `(\w+)`", text):
        if key not in ProviderSettings.model_fields:
            findings.append(f"ProviderSettings has no field {key!r}")
    for section, cell in _SECTION_ROW.findall(re.sub(r"per provider `\w+`", "", text)):
        models = _models_of(Settings.model_fields[section].annotation) if section in Settings.model_fields else []
        for model in models:
            fields = set(model.model_fields)
            for key in re.findall(r"`(\w+\*?)`", _outside_parentheses(cell)):
                known = any(f.startswith(key[:-1]) for f in fields) if key.endswith("*") else key in fields
                if not known:
                    findings.append(f"section {section!r}: {model.__name__} has no field {key!r}")
    return findings


@pytest.mark.parametrize("doc", DOCS)
def test_every_name_the_docs_cite_exists(doc: str) -> None:
    """Each module, name, file path, option and metric a document cites resolves against the checkout."""
    findings = check_markdown((ROOT / doc).read_text(encoding="utf-8"))
    assert not findings, f"{doc}:\n" + "\n".join(findings)


def test_readme_defaults_are_the_settings_defaults() -> None:
    """The README's default tiers and every "`key` (N unit)" it states equal `Settings()`'s values."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert _TIER_SENTENCE.search(" ".join(readme.split())), "the README lost its 'Default tiers:' sentence"
    assert check_defaults(readme) == []
    assert check_sections(readme) == []


def test_checker_reports_a_wrong_module_and_a_wrong_default() -> None:
    """A planted wrong module path and a planted wrong tier window are both reported; their fixes are not."""
    planted = ("The service lives in `mergebroker.broker.engine.chat.nowhere` and answers through "
               "`broker.engine.chat.service(body)`.\n\nDefault tiers: `realtime` (priority 100, window 10 ms, "
               "max_batch 4, similarity 0.85), `standard` (50, 50 ms, 4, 0.85) and `batch` (0, 250 ms, 8, any "
               "compatible request). A header must arrive within `header_timeout_s` (99 s).\n")
    findings = check_markdown(planted)
    assert any("mergebroker.broker.engine.chat.nowhere" in f for f in findings)
    assert any("'broker.engine.chat.service' does not resolve to a class or function" in f for f in findings)
    assert any("batch.window_ms is 1000.0, the docs say 250" in f for f in findings)
    assert any("header_timeout_s" in f for f in findings)
    fixed = planted.replace("chat.nowhere", "chat.service").replace("broker.engine.chat.service(body)",
                                                                    "broker.chat(body)")
    assert check_markdown(fixed.replace("250 ms", "1,000 ms").replace("(99 s)", "(10 s)")) == []


def test_checker_resolves_names_from_inside_a_room() -> None:
    """Paths and dotted names written from inside a package resolve by suffix; a wrong file name does not."""
    tree = repository()
    assert resolves_path(tree, "chat/service.py") and resolves_path(tree, "engine/wiring/assemble.py")
    assert not resolves_path(tree, "ratelimit_redis.py")
    assert resolves_dotted(tree, "merge_cost.decide") and resolves_dotted(tree, "Broker.chat")
    assert not resolves_dotted(tree, "Dispatcher._vectors")
    assert check_token(tree, "mergebroker_requests_total{endpoint,tier,status}") is None
    assert check_token(tree, "mergebroker_requests_total{tenant}") is not None


def test_every_allowlist_entry_is_still_needed() -> None:
    """Each ALLOWED token is still cited by some document and would be reported without its entry."""
    cited = {token.strip() for doc in DOCS for _, token in cited_tokens((ROOT / doc).read_text(encoding="utf-8"))}
    tree = repository()
    for token, why in list(ALLOWED.items()):
        assert why and any(token in c for c in cited), f"{token!r} is no longer cited"
        entry = ALLOWED.pop(token)
        try:
            assert check_token(tree, token) is not None, f"{token!r} resolves by rule: drop its entry"
        finally:
            ALLOWED[token] = entry
