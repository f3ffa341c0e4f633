"""The Hugging Face export: the LlamaForCausalLM folder, its tokenizer.json, PEFT adapters."""
