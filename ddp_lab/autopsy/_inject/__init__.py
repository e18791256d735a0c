"""Put on PYTHONPATH by ddp_lab.engine.launch (not imported as a package): see sitecustomize.py."""
