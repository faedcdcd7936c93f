"""Write a tiny random Llama as a Hugging Face folder (for examples/train.py and scripts/main.sh).

    python examples/tiny_checkpoint.py DIR
"""
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
LlamaForCausalLM(config).save_pretrained(sys.argv[1], max_shard_size="100KB")  # several files and an index
print(f"wrote {sys.argv[1]}")
