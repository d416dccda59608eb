"""`mergebroker warm-cache FILE`: embed a file of texts through the broker's own path to fill the caches."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from tqdm import tqdm

from mergebroker.broker.engine.ground.config import settings_for_command
from mergebroker.broker.engine.wiring.assemble import assemble, stop_engine
from mergebroker.errors import BrokerError


def run_warm_cache(args: argparse.Namespace) -> int:
    settings = settings_for_command(args.config)
    if settings is None:
        return 2
    try:
        lines = [line.strip() for line in Path(args.file).read_text(encoding="utf-8").splitlines()]
    except OSError as exc:
        print(f"mergebroker: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return 2
    texts = [line for line in lines if line]
    return asyncio.run(_warm(settings, texts, args.model, args.batch))


async def _warm(settings, texts: list[str], model: str, batch: int) -> int:
    broker = await assemble(settings)
    try:
        if not broker.embeddings.serves(model):
            print(f"mergebroker: no provider serves embedding model '{model}'", file=sys.stderr)
            return 2
        cached = 0
        with tqdm(total=len(texts), unit="text", desc="warming") as bar:
            for start in range(0, len(texts), batch):
                chunk = texts[start:start + batch]
                result = await broker.embeddings.embed_texts(model, chunk)
                cached += result.cached
                bar.update(len(chunk))
        print(f"{len(texts)} texts embedded, {cached} were already cached", file=sys.stderr)
        return 0
    except BrokerError as exc:
        print(f"mergebroker: {exc.message}", file=sys.stderr)
        return 1
    finally:
        await stop_engine(broker)
