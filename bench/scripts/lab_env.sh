# Sourced by the GPU run scripts: the environment every run starts from. Sets PYTHONPATH,
# creates $OUT, records the device; the lab-host shim: a .whl/ folder of wheels the
# machine's Python lacks (structlog, the grpc extras, xgrammar) is installed into
# /tmp/site (git-ignored; without it, nothing changes).
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-results-local}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=.:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
