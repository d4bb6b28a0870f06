"""Data: the default corpus, GPT datasets (megatron-core's indexed format), mock data, the sentencepiece tokenizer and preprocessing."""
