"""One small torchrun program per lesson probe: `launch.torchrun("-m ddp_lab.experiments.NAME")`."""
