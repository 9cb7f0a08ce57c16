#!/bin/bash
# Run from a clone with the real parts prepared; copy docs/results/real_table to runs/real_table first so that
# the finished runs are reused (fedllm compare checks their settings).
# The strategies table (docs/real-parts.md), then FLoRIST's tau sweep at seed 0 in the same folder.
cd "$(dirname "$0")/../../.."
. .venv/bin/activate
V="--variant fedit:aggregation.name=fedit --variant flora:aggregation.name=flora --variant flexlora:aggregation.name=flexlora --variant florist:aggregation.name=florist --variant fedex:aggregation.name=fedex --variant hetlora:aggregation.name=hetlora --variant fedsvd:aggregation.name=fedsvd --variant rolora:aggregation.name=rolora --variant local:aggregation.name=local --variant centralized:federation.num_clients=1,federation.clients_per_round=1,client.local_steps=16,lora.ranks=[64]"
nice fedllm compare --config configs/real_compare_smollm2_ni.yaml --seeds 3 --output-dir runs/real_table $V > runs/real_table.log 2>&1
# the sweep's own folder (its own compare.md; runs/florist_sweep is the ShareGPT sweep's); tau 0.9 and FlexLoRA at seed 0 are the table's runs, linked
mkdir -p runs/florist_sweep_ni/florist runs/florist_sweep_ni/flexlora
ln -sfn ../../real_table/florist/seed-0 runs/florist_sweep_ni/florist/seed-0
ln -sfn ../../real_table/flexlora/seed-0 runs/florist_sweep_ni/flexlora/seed-0
nice fedllm compare --config configs/real_compare_smollm2_ni.yaml --seed-list 0 --output-dir runs/florist_sweep_ni --variant florist:aggregation.name=florist --variant florist80:aggregation.name=florist,aggregation.florist.tau=0.8 --variant florist95:aggregation.name=florist,aggregation.florist.tau=0.95 --variant florist99:aggregation.name=florist,aggregation.florist.tau=0.99 --variant flexlora:aggregation.name=flexlora > runs/florist_sweep_ni.log 2>&1
