#!/usr/bin/env bash
# Pack what scripts/gpu_checks.sh needs on a lent GPU machine that has no package registry and no broker:
#   .whl/   the Python packages of the runtime its image may lack (Python 3.12, manylinux x86-64 wheels), and
#   .rmq/   this machine's RabbitMQ and Erlang (Debian's packages: /usr/lib/rabbitmq, /usr/lib/erlang) as one
#           tar.xz that gpu_checks.sh unpacks into the same paths there, so the runtime's broker tests and
#           benchmarks run on the GPU machine's 16 cores.
# Both folders are ignored by git (.git/info/exclude) and travel with the device tool's `carry`. About 43 MB.
#
#     bash scripts/pack_device_bundle.sh
set -euo pipefail
cd "$(dirname "$0")/.."
for ignored in /.whl/ /.rmq/; do
  grep -qxF "$ignored" .git/info/exclude 2>/dev/null || echo "$ignored" >> .git/info/exclude
done
mkdir -p .whl .rmq
version() { python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
wheels=()
for name in pika SQLAlchemy fastapi starlette uvicorn pydantic pydantic_core typing-inspection annotated-types \
            typing_extensions annotated-doc opentelemetry-api anyio mlxtend; do
  wheels+=("$name==$(version "$name")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${wheels[@]}"
if [ ! -d /usr/lib/rabbitmq ] || [ ! -d /usr/lib/erlang ]; then
  echo "pack_device_bundle.sh: RabbitMQ is not installed here (scripts/install_rabbitmq.sh)" >&2
  exit 1
fi
tar -C / -cJf .rmq/rabbitmq.tar.xz --exclude='usr/lib/erlang/man' --exclude='*/doc/*' usr/lib/erlang usr/lib/rabbitmq
du -sh .whl .rmq
