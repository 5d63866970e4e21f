"""A backend that prints on stdout (Python and C level) while it works: the protocol server must keep
the reply stream clean. Used as --backend chatty_backend:ChattyBackend with PYTHONPATH set here."""
import os

from conformance.backends.refimpl_backend import RefimplBackend


class ChattyBackend(RefimplBackend):
    def open(self, model_dir):
        print("chatty: python print while opening")
        os.write(1, b"chatty: file descriptor 1 while opening\n")
        super().open(model_dir)

    def run(self, request):
        print("chatty: python print while running")
        os.write(1, b"chatty: file descriptor 1 while running\n")
        return super().run(request)
