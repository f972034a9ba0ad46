"""Speculative decoding: proposers (`ngram`), the speculative config, and the verification
of a proposal run against the target model's logits (`verify.py`)."""
