"""A user's project outside the ember package, imported by `_target_: my_project.models.Net`."""
