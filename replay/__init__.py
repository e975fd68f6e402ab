"""The replay planner and GPU worker (SWA bounded replay): not built yet; see the issues."""
