"""Answers as clients read them: token ids to text (tokens.py, text_stream.py), logprobs in
OpenAI's shapes (logprobs_format.py) and JSON written a piece at a time (json_out.py)."""
