"""Put on PYTHONPATH by ddp_lab.launch (not imported as a package): see sitecustomize.py."""
