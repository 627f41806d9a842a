"""The OpenAI-compatible HTTP server, with test-time search as an API call (`/v1/search`)."""
