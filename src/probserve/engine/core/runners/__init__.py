"""The runners (paged.py: probserve's own forward; hf.py: transformers') and the choice of one
for a model (choice.py)."""
