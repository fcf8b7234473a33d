"""Explaining a plan, finding what user code keeps on the device, report tables."""
