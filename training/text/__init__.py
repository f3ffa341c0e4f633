"""The text room (shared base): normalization, the SentencePiece tokenizer, the chat template, fertility, vocabulary extension, Bengali well-formedness."""
