# kvstore server image: `kvstore serve` on port 8470 (see docker-compose.yml).
FROM python:3.11-slim

WORKDIR /app
# The CPU build of torch: PyPI's default Linux wheel is a multi-GB CUDA build.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml setup.py README.md ./
COPY kvstore ./kvstore
COPY tiers ./tiers
COPY server ./server
COPY client_sdk ./client_sdk
COPY bench ./bench
# gcc builds the int8 kernel (kvstore/_int8.c; without it torch quantizes, a few times slower)
# and leaves the image again once it has.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install --no-cache-dir . \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*

ENV KVSTORE_DATA_DIR=/data
EXPOSE 8470
# SIGTERM (docker stop) drains in-flight requests, flushes the durable tiers and unlinks shm.
STOPSIGNAL SIGTERM
CMD ["kvstore", "serve"]
