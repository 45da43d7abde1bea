"""The generators behind ``scripts/generate_docs.py``: the reference pages of docs/reference/ and the README's
slot list, read from the registries, the compatibility rules and the command lines' help."""
