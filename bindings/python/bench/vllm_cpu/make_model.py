#!/usr/bin/env python3
"""A tiny random-weight Llama (4 layers, hidden 256, 4 heads, vocab 2048, bf16) and a local
word-level tokenizer ("w3 w4 ..." are single tokens), so `vllm serve` runs offline on a CPU.

Usage: make_model.py OUT_DIR   (run with the vLLM venv's python: needs torch, transformers)
"""
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out = sys.argv[1]
V = 2048
vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
for i in range(3, V):
    vocab[f"w{i}"] = i
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
fast.save_pretrained(out)
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=V, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="bfloat16")
m = LlamaForCausalLM(cfg).to(torch.bfloat16)
m.save_pretrained(out)
print("model written to", out)
