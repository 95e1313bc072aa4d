#!/bin/bash
# (Never ran: no machine came. The round_logits it tests is now notes/round_logits.patch: apply it first.)
# session 74's device call: the L2 size, the full CUDA suite (round_logits, the two-GPU and misaligned-weights tests),
# the selection sanitizers, bench_select (Qwen3: the round_logits branch untimed before), and on an H200 with time
# left, the e2e refresh
python3 -c "import torch; p = torch.cuda.get_device_properties(0)
print(p.name, 'L2', p.L2_cache_size, 'SMs', p.multi_processor_count)"
bash notes/device_trial.sh tall selsan
[ $SECONDS -lt 330 ] && bash notes/device_trial.sh bsel
if nvidia-smi -L | grep -q H200 && [ $SECONDS -lt 360 ]; then bash notes/device_trial.sh e2e | grep -v "^[0-9.]*+"; fi
echo "call wall $SECONDS s"
