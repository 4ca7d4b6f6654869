"""Training: the loop and its parts (setup, step, validation), schedules, resume state,
checkpoints, the run's log, fine-tuning, DDP, data preparation and dev/test scoring. Imports
decoding and what is below it.
"""
