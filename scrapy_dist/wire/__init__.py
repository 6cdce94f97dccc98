"""The wire format: requests encoded for the queue (msgpack, never pickle), the trust policy that decides
what an untrusted entry may carry, the callbacks an entry may name, seed fields and rejection records. May
import: ``settings``, ``redis`` (key names, replies), ``utils`` and the root's exceptions."""
