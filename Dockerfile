# mergebroker: slim Python, CPU-only torch, non-root, health-checked.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    MERGEBROKER_SERVER__HOST=0.0.0.0 \
    MERGEBROKER_SERVER__PORT=8080

WORKDIR /app
# CPU torch first and pinned, so nothing later pulls another build. Pass PyTorch's CPU wheel index as
# TORCH_INDEX_URL (see README, "Docker") for a CPU-only image; without it pip takes the default index's build.
ARG TORCH_INDEX_URL=""
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL"; \
    else pip install torch==2.13.0; fi
COPY pyproject.toml setup.py README.md ./
COPY core ./core
COPY broker ./broker
COPY merge ./merge
COPY breaker ./breaker
COPY providers ./providers
COPY configs ./configs
RUN pip install . \
    && useradd --create-home --uid 10001 broker \
    && mkdir -p /var/lib/mergebroker && chown broker /var/lib/mergebroker \
    && python -m mergebroker.providers.local.onnx_export --cache-dir /opt/mergebroker/onnx
ENV MERGEBROKER_EMBEDDINGS__ONNX_CACHE_DIR=/opt/mergebroker/onnx

USER broker
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2); sys.exit(0)"
ENTRYPOINT ["mergebroker"]
CMD ["serve"]
