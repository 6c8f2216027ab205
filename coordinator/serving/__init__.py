"""Text in, text out: the checkpoint's tokenizer and text streams (text.py), and the
OpenAI-style HTTP front on Ray Serve (app.py), a client of the job's engine."""
