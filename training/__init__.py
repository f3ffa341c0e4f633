"""prodip training: the one model definition, tokenizer, data format, checkpoint format and loop.

`training` imports no other prodip stage (serving, export and demo import it).
"""
