#!/bin/bash
# Session 78: the tables README's measured-performance section owes a run at the head. On an H200: the selection (both
# models), the Qwen3 layer table (bench_layer now rotates the router and predictor weights with the expert
# weights, never run on a GPU before) and the end-to-end table (session 59's until now). On another GPU: the Qwen3
# layer table and the end-to-end table (README's H100 paragraphs). `bash notes/s78_call3.sh` (~350-420 s with the
# build). OLMoE's table (layero) is left for a call with more budget.
python3 -c "import torch, torch.cuda as c; print(c.get_device_name(), torch.__version__, 'L2', c.get_device_properties(0).L2_cache_size)"
if nvidia-smi -L | grep -q H200; then steps="bselall layerq e2e"; else steps="layerq e2e"; fi
bash notes/device_trial.sh $steps | grep -v "^[0-9.]*+"
echo "call wall $SECONDS s"
