"""Tokenizer service: chat templates and tokenizing in, detokenizing and stop strings out."""
