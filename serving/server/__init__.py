"""The HTTP server over one Backend (OpenAI-compatible), its request schema, routes, scheduler, and the web export's local host."""
