"""The lessons: one module per topic, a subpackage where a topic needs several modules.

The programs the lessons launch live in ddp_lab/experiments/ (one small torchrun program per probe).
"""
