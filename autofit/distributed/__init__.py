"""Torch.distributed: the lockstep every rank keeps."""
