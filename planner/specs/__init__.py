"""What the work runs on: model architectures (presets and HF configs), clusters and
devices, device meshes, parallel layouts and the parameter slices a layout gives each
rank."""
