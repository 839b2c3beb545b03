# Sourced by run_a.sh and run_b.sh, from the repository root, on the GPU machine: the
# wheels it lacks (.whl/), the search core built for its Python (.dev/), a `realign`
# command on PATH.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
cp .dev/_core.cpython-312-x86_64-linux-gnu.so planner/
mkdir -p bin && printf '#!/bin/bash\nexec python3 -m realign.cli.main "$@"\n' > bin/realign && chmod +x bin/realign
export PATH=$PWD/bin:$PATH
