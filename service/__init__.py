"""The model server: engine (llama.cpp), model registry, HTTP API."""
