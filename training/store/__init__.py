"""The store room (shared base): store URLs, a run folder and a data folder in object storage, the mirror's uploader."""
