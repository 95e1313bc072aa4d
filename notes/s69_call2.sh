# session 69, call 2: every CUDA test and the whole test_hf at the head of wip/voting-ops; then two mutants of the
# kernel's voting code (each must fail the voting tests): A, the flags ignored in the token loop; B, TOP1_UNION's
# offset counting every token
set -o pipefail
nvidia-smi -L
build() { MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a python3 setup.py build_ext --inplace > $OUT/build_$1.log 2>&1 || { tail -30 $OUT/build_$1.log; exit 1; }; }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
build head
python3 -m pytest -q -p no:cacheprovider -m cuda tests 2>&1 | tee $OUT/t_cuda_all.log | tail -2
python3 -m pytest -q -p no:cacheprovider tests/test_hf.py -rs 2>&1 | tee $OUT/t_hf.log | grep -E "SKIPPED.*torch_compile|passed|failed" | cut -c1-300 | tail -4
VOTING="voting or top1_union_offset"
cp csrc/route_select.cu /tmp/route_select.cu
sed -i 's/const bool votes = p.voting == nullptr || p.voting\[t\];/const bool votes = true;/' csrc/route_select.cu
grep -c "const bool votes = true;" csrc/route_select.cu; build A
echo "mutant A:"; python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_ops.py tests/test_policies.py -k "$VOTING" 2>&1 | tail -1
cp /tmp/route_select.cu csrc/route_select.cu
sed -i 's/if (p.voting == nullptr || p.cost != Cost::kTop1Union || !p.compute_cost) return p.top1_offset;/return p.top1_offset;/' csrc/route_select.cu
grep -c "^  return p.top1_offset;" csrc/route_select.cu; build B
echo "mutant B:"; python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_ops.py tests/test_policies.py -k "$VOTING" 2>&1 | tail -1
cp /tmp/route_select.cu csrc/route_select.cu
echo "total $SECONDS s"
