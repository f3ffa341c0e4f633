"""prodip demo: the Gradio Bangla chat (demo.app) and, on top, the quickstart pipeline."""
