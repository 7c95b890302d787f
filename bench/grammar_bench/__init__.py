"""The pieces of bench/grammar_engines.py (the command): tokenizers, schemas and the validator, the engines, one
trial in a forked child, the report and its verdict."""
