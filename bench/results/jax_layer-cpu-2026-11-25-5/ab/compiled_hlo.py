# The step-by-step moe_layer forward + backward compiled, metadata dropped:
#   .venv/bin/python compiled_hlo.py OUT.txt
# Compared: grep -v '{file_name_id\|^[0-9]* {\|^[0-9]* "' OUT.txt, numbered names (.N) dropped.
import sys, jax, jax.numpy as jnp, numpy as np
import moekit.jax as mj
T,H,F,E=64,32,16,8
r=np.random.default_rng(0)
x=jnp.asarray(r.standard_normal((T,H)),jnp.bfloat16)
p=mj.MoeParams(*(jnp.asarray(r.standard_normal(s)*0.1,jnp.bfloat16) for s in ((H,E),(E,H,2*F),(E,F,H))))
def loss(x,p):
    out,aux=mj.moe_layer(x,p,k=2,aux_loss_coeff=0.01,fused=False)
    return jnp.sum(out.astype(jnp.float32))+aux.aux_loss
txt=jax.jit(jax.value_and_grad(loss,(0,1))).lower(x,p).compile().as_text()
import re
open(sys.argv[1], "w").write(re.sub(r", metadata=\{[^}]*\}", "", txt))  # noqa
