# session 57 call 3: the never-run selection trims (notes/PATCHES.md) against main in one build sequence, both models'
# selection at T = 1 / 4 / 16 / 64 (H100 or H200: read each variant against main of the same call)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
TOKENS=1,4,16,64 bash notes/compare_variants.sh -s bselt main= rpb=notes/rp_bias_early.patch \
  tom=notes/topk_owner_mask.patch sel=notes/select_rank_unroll.patch,notes/select_ks_sum.patch
