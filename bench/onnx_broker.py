"""`python -m bench.onnx_broker serve ...`: the `mergebroker` command with the similarity model's int8 copy on
onnxruntime, for benchmarks run before `merge.embedder: local-onnx` is wired into the settings.

It only changes `SentenceModelHost`'s default `int8_runtime`; `merge.embedder: local-int8` then builds the
onnxruntime copy (falling back to torch's, logged, as the broker would).
"""

from __future__ import annotations

import sys

from mergebroker.providers.local_model import SentenceModelHost

if __name__ == "__main__":
    SentenceModelHost.__init__.__kwdefaults__["int8_runtime"] = "onnx"
    from mergebroker.broker.cli import main

    sys.exit(main())
