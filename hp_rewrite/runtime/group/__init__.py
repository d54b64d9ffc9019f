"""The EP group and where experts live: meshes, groups, placement, the TP token share."""
