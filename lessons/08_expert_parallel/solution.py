"""Lesson 08 exercises — reference solutions. (The exercise file, lessons/08_expert_parallel/exercise.py, is the
same file with the marked pieces left to write.)"""
import torch
import torch.distributed as dist


def top_k_route(logits, k):
    """EXERCISE 1: softmax over the experts, the k largest, renormalised (Mixtral)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = probs.topk(k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), experts


def dispatch_permutation(experts, num_experts):
    """EXERCISE 2: (token, choice) pairs sorted by expert, stable: each expert's pairs contiguous, in token order."""
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts)


def aux_loss(probs, experts, num_experts):
    """EXERCISE 3: E · Σ_e f_e P_e, f_e = choices of expert e per token (Σf = k), P_e = mean probability."""
    f = torch.bincount(experts.flatten(), minlength=num_experts).to(probs.dtype) / probs.shape[0]
    return num_experts * (f * probs.mean(0)).sum()


def exchange_splits(counts, group=None):
    """EXERCISE 4: rows to each rank (its experts are contiguous), and, after one all-to-all of the counts, the
    rows each rank will send here."""
    ep = dist.get_world_size(group)
    send = counts.view(ep, -1).sum(1)  # rank j's experts: the j-th block of E/ep counts
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j] = rank j's send[me]
    return send.tolist(), recv.tolist()


def deepseek_router_step(logits, k, bias, gamma):
    """EXERCISE 5: top-k of sigmoid + bias; gates = the chosen sigmoids renormalised; bias moved by ±γ against load."""
    scores = torch.sigmoid(logits.float())
    experts = (scores + bias).topk(k, dim=-1).indices
    weights = scores.gather(-1, experts)
    load = torch.bincount(experts.flatten(), minlength=scores.shape[-1]).float()
    return weights / weights.sum(-1, keepdim=True), experts, bias + gamma * torch.sign(load.mean() - load)


def two_part_exposed(a, c, s):
    """EXERCISE 6: the two-part schedule on one link (picotron.planner.ep_overlap_exposed_seconds is the same)."""
    start1 = max(a, s)  # dispatch 1 has arrived and the shared expert is done
    link = max(2 * a, start1 + c) + a  # combine 1: launched after experts 1, on the link after dispatch 2
    start2 = max(2 * a, start1 + c)  # dispatch 2 has arrived and experts 1 are done
    end = max(link, start2 + c) + a  # combine 2: after experts 2 and after combine 1 left the link
    return end - (s + 2 * c)
