"""A plain Horovod + TensorFlow 2 training loop (``DistributedGradientTape`` inside ``tf.function``).

    horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo python examples/tf_train.py
    blinkrun   -np 4 -H localhost:2,127.0.0.1:2 --gloo python examples/tf_train.py

Nothing here knows about Blink: with ``BLINK_ENABLE=1`` the gradient allreduce
of the tape and ``hvd.broadcast_variables`` run through Blink (as
``tf.py_function`` ops inside the graph).  ``--save FILE`` writes rank 0's weights.
"""

import argparse
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=15, help="optimizer steps")
    ap.add_argument("--batch", type=int, default=32, help="examples per rank and step")
    ap.add_argument("--save", default="", help="rank 0 saves the trained weights here (.npz)")
    args = ap.parse_args()

    hvd.init()
    tf.random.set_seed(1234 + hvd.rank())  # different initial weights: the broadcast fixes them
    w1 = tf.Variable(tf.random.normal([32, 128], stddev=0.1))
    b1 = tf.Variable(tf.zeros([128]))
    w2 = tf.Variable(tf.random.normal([128, 10], stddev=0.1))
    variables = [w1, b1, w2]
    opt = tf.optimizers.SGD(0.01 * hvd.size(), momentum=0.9)

    @tf.function
    def train_step(x, y, first):
        with tf.GradientTape() as tape:
            logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return loss

    rng = np.random.default_rng(42 + hvd.rank())
    for step in range(args.steps):
        x = tf.constant(rng.standard_normal((args.batch, 32)).astype(np.float32))
        y = tf.constant(rng.integers(0, 10, args.batch).astype(np.int32))
        if step == 0:
            hvd.broadcast_variables(variables, root_rank=0)
        loss = train_step(x, y, step == 0)
        if step == 0:
            hvd.broadcast_variables(opt.variables, root_rank=0)
        if hvd.rank() == 0:
            print(f"step {step:3d}  loss {float(loss):.5f}", flush=True)
    if args.save and hvd.rank() == 0:
        np.savez(args.save, **{f"v{i}": v.numpy() for i, v in enumerate(variables)})


if __name__ == "__main__":
    main()
