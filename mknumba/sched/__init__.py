"""Tile order, persistent grid sizing and the SM partition between roles."""
from .tiles import GridPlan, cdiv, plan_grid, grouped_order, tile_coords_host

__all__ = ["GridPlan", "cdiv", "plan_grid", "grouped_order", "tile_coords_host"]
