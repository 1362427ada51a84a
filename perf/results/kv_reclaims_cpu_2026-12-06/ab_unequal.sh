# The KV budget (this tree) against bb87d7e (the tree before it), served on the CPU, the large model's pool half the
# small one's. From the repository root: mkdir -p /tmp/kvb-base && git archive bb87d7e backends | tar -x -C /tmp/kvb-base
# The stubs import tokenrouter through the venv's editable path: it is pointed at each tree in turn.
set -u
pth=$(ls .venv/lib/python3*/site-packages/__editable__.tokenrouter-*.pth)
trap 'echo "$PWD/backends" > $pth' EXIT
echo /tmp/kvb-base/backends > $pth
echo "base bb87d7e:"
timeout 1200 .venv/bin/python perf/results/kv_reclaims_cpu_2026-12-06/pressure.py 6 32768 16384 > /tmp/pr_u_base.log 2>&1
tail -1 /tmp/pr_u_base.log
echo "$PWD/backends" > $pth
echo "new:"
timeout 1200 .venv/bin/python perf/results/kv_reclaims_cpu_2026-12-06/pressure.py 6 32768 16384 > /tmp/pr_u_new.log 2>&1
tail -1 /tmp/pr_u_new.log
