"""Tool calls: the functions a chat request offers (`tools`), how the model's template is told
of them and of earlier calls and results, the grammar `tool_choice` needs, and the reply's text
split into content and OpenAI's `tool_calls`, streamed or whole, one way for both."""
